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

Chunks whose optimizer lives on the host (offload.py) step one chunk at a time, in the order the next
forward needs them, and each updated shard starts its upload (and, at stages 1-2, its all-gather)
while the next chunk steps. An optimizer that can write the 16-bit copy in the same pass as the
update (zeroshard.CPUAdamW) is given the copy's destination, saving a pass over the master.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .offload import Pending


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


class ShardedOptimizer:
    def __init__(self, make_opt, comm, *, stage: int, dtype: torch.dtype, accumulation: int,
                 clip_grad_norm: float | None, scaler: LossScaler | None):
        self.make_opt = make_opt
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
        self._staging = [(None, None), (None, None)]  # (host buffer, upload reading it)
        self._staging_turn = 0
        self._staging_slot_of: dict[int, int] = {}
        self._targets: dict[int, torch.Tensor | None] = {}

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
        on_host = [c for c in self.chunks if c.placement.optimizer_on_host]
        gathers = []
        if not on_host or len(self.optimizer.param_groups) > 1:  # one step over every chunk
            self._step_chunks(self.chunks)
            for c in self.chunks:
                self._publish(c, gathers)
        else:
            on_device = [c for c in self.chunks if not c.placement.optimizer_on_host]
            if on_device:
                self._step_chunks(on_device)
                for c in on_device:
                    self._publish(c, gathers)
            for c in on_host:  # in the order the next forward needs them
                self._step_chunks([c])
                self._publish(c, gathers)
        for w in gathers:
            if w is not None:
                w.wait()
        self._drop_grads()
        return True

    def _step_chunks(self, chunks) -> None:
        """optimizer.step() over these chunks' masters only (all of them: one plain step)."""
        fused_copy = getattr(self.optimizer, "copy_targets", None)
        for c in chunks:
            target = self._targets[id(c)] = self._copy_target(c, ring=len(chunks) == 1)
            if target is not None and fused_copy is not None:
                fused_copy[id(c.master)] = target
        if len(chunks) == len(self.chunks):
            self.optimizer.step()
            return
        group = self.optimizer.param_groups[0]
        saved, group["params"] = group["params"], [c.master for c in chunks]
        try:
            self.optimizer.step()
        finally:
            group["params"] = saved

    def _copy_target(self, c, ring: bool) -> torch.Tensor | None:
        """Where the 16-bit copy of an updated master goes when it can be written on the master's
        side: the shard itself when both live on the same side, a host staging buffer when the
        master is on the host and the shard on the device, a device buffer when it is the other way
        round. None in fp32: the master itself is (or is copied into) the shard. `ring`: chunks
        step one at a time, so host staging buffers can be reused (see _staging_for)."""
        if c.master_is_shard:
            return None
        shard_on_host = c.stage == 3 and c.placement.params_on_host
        if c.placement.optimizer_on_host == shard_on_host:
            return c.shard
        if self.dtype == torch.float32:
            return None
        if c.placement.optimizer_on_host:
            return self._staging_for(c) if ring else c.transfer.host_empty(c.master.numel(), self.dtype)
        # master on the device, shard on the host: convert on the device, then download
        return torch.empty(c.master.numel(), dtype=self.dtype, device=c.master.device)

    def _staging_for(self, c) -> torch.Tensor:
        """A host 16-bit buffer for uploading chunk c's update: a ring of two buffers (ZeRO-R's
        constant-size buffers), each reused only once the upload that last read it has finished."""
        slot = self._staging_turn
        self._staging_turn ^= 1
        buf, reader = self._staging[slot]
        if reader is not None:
            reader.sync()
        if buf is None:
            buf = c.transfer.host_empty(max(x.master.numel() for x in self.chunks), self.dtype)
        self._staging[slot] = (buf, None)
        self._staging_slot_of[id(c)] = slot
        return buf[:c.master.numel()]

    def _publish(self, c, gathers: list) -> None:
        """Bring chunk c's updated master into its compute shard, then (stages 1-2) start the
        all-gather that gives every rank the whole updated chunk."""
        if not c.master_is_shard:
            target = self._targets.pop(id(c))
            if target is not None and id(c.master) not in getattr(self.optimizer, "copied", ()):
                target.copy_(c.master)
            if target is c.shard:
                pass
            elif c.placement.optimizer_on_host:  # master on the host, shard on the device: upload
                upload = c.transfer.to_device(c.master if target is None else target, out=c.shard)
                slot = self._staging_slot_of.pop(id(c), None)
                if slot is not None:
                    self._staging[slot] = (self._staging[slot][0], upload)
                upload.wait()
            else:  # master on the device, shard offloaded to the host: download
                c.transfer.to_host(c.master if target is None else target, out=c.shard).wait()
        if self.stage in (1, 2):
            gathers.append(self.comm.all_gather(c.full, c.shard, async_op=True))

    def _clip(self) -> float:
        sq = torch.zeros(1, dtype=torch.float32, device=self.comm.device)
        for c in self.chunks:
            sq += c.master.grad.pow(2).sum().to(sq.device)
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
        if hasattr(self.optimizer, "copied"):
            self.optimizer.copied.clear()

    def state_bytes(self) -> dict[bool, int]:
        """Bytes of the optimizer's own state tensors (moments etc.) on this rank, by whether they
        are on the host."""
        host_of = {id(c.master): c.placement.optimizer_on_host for c in self.chunks}
        out = {False: 0, True: 0}
        for p, st in self.optimizer.state.items():
            out[host_of.get(id(p), False)] += sum(v.numel() * v.element_size() for v in st.values()
                                                  if isinstance(v, torch.Tensor) and v.dim() > 0)
        return out
