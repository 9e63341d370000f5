"""The figures `engine.stats()` reports after each optimizer step, gathered from the parts that
count them (collectives, transfers, the rCache, chunks, the optimizer), whose counters then restart.

Keys: `comm_elements` (payload elements this rank moved, counted as the ZeRO paper does: an
all-reduce of M elements 2M, a reduce-scatter or all-gather M), `control_collectives` (small ones:
norms, overflow flags), `order_checks` (tag comparisons on the check group, ordering.py), `model_state_bytes` and `model_state_bytes_by_kind` (bytes of
'params', 'grads' and 'optimizer' states this rank keeps between steps; transient buffers and the
stage-3 cache excluded), `model_state_bytes_by_device` (the same split into 'device' and 'host'),
`transfer_bytes` ('h2d' and 'd2h' bytes copied since the previous step), `cache_peak_chunks` and
`cache_peak_bytes` (the most gathered chunks held at once), `cache_overflows`,
`schedule_departures`, `device_model_bytes` (model states on the device plus the rCache's peak: what
the planner predicts), `loss_scale`, `grad_norm` (the global L2 norm of the step's gradient over all
ranks, before clipping; None with config grad_norm=False and no clipping, or when the step was
skipped), `skipped_steps` (optimizer steps skipped since the start for a non-finite gradient: fp16
overflow, config nonfinite='skip'), and counts of parameters, chunks and padded elements.
The disk tier (offload_optimizer='disk'): 'disk' in `model_state_bytes_by_device` (the records
written there), and `disk_tier` ({'read_bytes', 'written_bytes' since the previous step;
'read_wait_s', 'write_wait_s': what the step waited for reads and for frames being written;
'read_busy_s', 'write_busy_s', 'io_busy_s': seconds with a read, a write, either in flight; 'buffer_bytes': the host
frames}); None without it. With offload_params='disk', `param_tier` has the same figures for the
parameter tier (its shards, read at each gather), whose bytes 'disk' counts too; None without it.
Hybrid sharding (config shard_group_size) and hpZ (hpz_group_size): `shard_group_size` (G; the
data-parallel world when not hybrid), `hpz_group_size` (None without hpZ) and
`comm_elements_by_link` ({'inside': elements over the shard group or hpZ's secondary group,
'across': over groups spanning several}; their sum is `comm_elements`; docs/communication.md).

With tensor parallelism (tensor_parallel.py) the counts above are of the data-parallel group
(`world_size` is its size; parameter counts are this rank's local shards); `tensor_parallel` is the
TP degree. `saved_activation_bytes` ({'device': bytes, 'host': bytes} the last training forward
saved for backward, each storage once; None unless P_a or activation offload is on), and with P_a
`pa_elements` (elements P_a's all-gathers moved over the TP group since the previous step, counted
as the paper counts an all-gather), `pa_partitioned_elements` (whole, padded elements of the tensors it
kept partitioned since then: each is gathered once in backward) and `pa_fingerprints` (its
replication checks).

What a training loop watches (StepMeter): `loss` (the mean of the losses this rank gave
engine.backward since the previous step: this rank's micro-batches only; None when backward ran as
loss.backward()), `lr` (the first param group's learning rate this step used) and `lrs` (every
group's), `step_time_s` (host wall time from the end of the previous step(), or for the first step
from its first training forward, to the end of this one: forwards, backwards and the update), `samples_per_s` and `tokens_per_s` (this rank's training
micro-batches since the previous step, times the world size, over step_time_s: a global rate when
ranks take equal micro-batches; samples are the first tensor argument's leading dimension, tokens
the elements of `input_ids`, else of the first integer tensor argument; None without one).
"""
from __future__ import annotations

import time

import torch


class StepMeter:
    """Counts what one optimizer step's micro-batches fed and cost, on the host without waiting
    for the device (the losses stay tensors until the step ends)."""

    def __init__(self):
        self.started: float | None = None  # the first training forward's start, until a step ends
        self.losses: list[torch.Tensor] = []
        self.samples = self.tokens = 0

    def forward(self, args: tuple, kwargs: dict) -> None:
        """A training forward's inputs (called with gradients enabled)."""
        if self.started is None:
            self.started = time.perf_counter()
        tensors = [a for a in args if torch.is_tensor(a)] + [v for v in kwargs.values() if torch.is_tensor(v)]
        if tensors and tensors[0].dim() > 0:
            self.samples += tensors[0].shape[0]
        ids = kwargs.get("input_ids")
        if not torch.is_tensor(ids):
            ids = next((t for t in tensors if not t.is_floating_point() and not t.is_complex()
                        and t.dtype is not torch.bool), None)
        if ids is not None:
            self.tokens += ids.numel()

    def loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    def finish(self, world: int, optimizer) -> dict:
        """The step's figures; starts the next step's count."""
        now = time.perf_counter()
        seconds = now - (self.started if self.started is not None else now)
        loss = float(torch.stack([x.float().mean() for x in self.losses]).mean()) if self.losses else None
        lrs = [float(g["lr"]) for g in optimizer.param_groups if "lr" in g] if optimizer is not None else []
        rate = lambda n: n * world / seconds if n and seconds > 0 else None  # noqa: E731
        out = {"loss": loss, "lr": lrs[0] if lrs else None, "lrs": lrs, "step_time_s": seconds,
               "samples_per_s": rate(self.samples), "tokens_per_s": rate(self.tokens)}
        self.started, self.losses, self.samples, self.tokens = now, [], 0, 0
        return out


def chunk_state_bytes(c) -> list[tuple[str, bool, int]]:
    """Persistent bytes chunk `c` holds on this rank, as (kind, on host, bytes) with kind 'params',
    'secondary' (hpZ), 'grads' or 'master' (the optimizer's own states are counted apart)."""
    el, gel = c.dtype.itemsize, c.grad_dtype.itemsize
    out = [] if c.shard_tier is not None else [  # a shard in the parameter tier: counted as "disk"
        ("params", c.stage == 3 and c.placement.params_on_host, (c.shard_numel if c.stage == 3 else c.padded_numel) * el)]
    if c.secondary is not None:
        out.append(("secondary", False, c.secondary.nbytes))
    if c.trainable:
        if c.stage <= 1:  # the full gradient stays on the device for accumulation
            out.append(("grads", False, c.padded_numel * gel))
        if c.stage >= 2 or c.placement.optimizer_on_host:
            out.append(("grads", c.placement.optimizer_on_host, c.shard_numel * gel))
    if c.master is not None and not c.master_is_shard:
        out.append(("master", c.placement.optimizer_on_host, c.master.numel() * 4))
    return out


def model_state_bytes(chunks, optim) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of model states this rank keeps between steps, by kind ('params', 'grads', 'optimizer':
    fp32 masters and the optimizer's states; with hpZ, 'secondary': the secondary shards) and by
    where ('device', 'host')."""
    opt_bytes = optim.state_bytes()
    by_kind = {"params": 0, "grads": 0, "optimizer": sum(opt_bytes.values())}
    if any(c.secondary is not None for c in chunks):
        by_kind["secondary"] = 0
    by_device = {"device": opt_bytes[False], "host": opt_bytes[True]}
    for c in chunks:
        for kind, on_host, n in chunk_state_bytes(c):
            by_kind["optimizer" if kind == "master" else kind] += n
            by_device["host" if on_host else "device"] += n
    if optim.tier is not None:
        by_device["disk"] = optim.tier.bytes_on_disk()
        by_kind["optimizer"] += by_device["disk"]
    params_tier = shard_tier(chunks)
    if params_tier is not None:
        by_device["disk"] = by_device.get("disk", 0) + params_tier.bytes_on_disk()
        by_kind["params"] += params_tier.bytes_on_disk()
    return by_kind, by_device


def shard_tier(chunks):
    """The parameter tier (offload_params='disk'), or None."""
    return next((c.shard_tier for c in chunks if c.shard_tier is not None), None)


def tier_stats(tier) -> dict | None:
    """A disk tier's figures since the last reset (which this starts)."""
    if tier is None:
        return None
    out = {"read_bytes": tier.read_bytes, "written_bytes": tier.written_bytes, "read_wait_s": tier.read_wait_s,
           "write_wait_s": tier.write_wait_s, "read_busy_s": tier.meter.busy_s["read"],
           "write_busy_s": tier.meter.busy_s["write"], "io_busy_s": tier.meter.busy_s["any"],
           "buffer_bytes": tier.buffer_bytes()}
    tier.reset_counters()
    return out


def step_stats(meter: dict, *, step: int, applied: bool, chunks, optim, cache, comm, shards, transfer, saved,
               scaler, tp) -> dict:
    """The figures of the step just taken (`meter`: StepMeter.finish's; `step`: optimizer steps
    applied so far), from the parts that counted them; restarts their counters."""
    by_kind, by_device = model_state_bytes(chunks, optim)
    out = {
        **meter,
        "step": step,
        "applied": applied,
        "comm_elements": shards.elements,
        "comm_elements_by_link": shards.elements_by_link(),
        "shard_group_size": shards.size,
        "hpz_group_size": shards.secondary_size if shards.hpz else None,
        "control_collectives": comm.control_collectives,
        "order_checks": comm.order_checks,
        "model_state_bytes": sum(by_kind.values()),
        "model_state_bytes_by_kind": by_kind,
        "model_state_bytes_by_device": by_device,
        "transfer_bytes": {"h2d": transfer.h2d_bytes, "d2h": transfer.d2h_bytes},
        "num_params": sum(s.numel for c in chunks for s in c.slots),
        "num_chunks": len(chunks),
        "padded_elements": sum(c.padded_numel for c in chunks),
        "cache_peak_chunks": cache.peak,
        "cache_peak_bytes": cache.peak_bytes,
        "cache_overflows": cache.overflows,
        "schedule_departures": cache.departures,
        "device_model_bytes": by_device["device"] + cache.peak_bytes,
        "loss_scale": scaler.scale if scaler else None,
        "grad_norm": optim.last_grad_norm,
        "skipped_steps": optim.skipped_steps,
        "world_size": comm.world,
        "tensor_parallel": tp.degree if tp is not None else 1,
        "saved_activation_bytes": dict(saved.saved_bytes) if saved.saved_bytes is not None else None,
    }
    out["disk_tier"] = tier_stats(optim.tier)
    out["param_tier"] = tier_stats(shard_tier(chunks))
    partition = saved.partition
    if partition is not None:
        out["pa_elements"], out["pa_fingerprints"] = partition.comm.elements, partition.fingerprints
        out["pa_partitioned_elements"] = partition.partitioned_elements
        partition.reset_counters()
    shards.reset_counters()  # the data-parallel group's too
    transfer.reset_counters()
    cache.reset_peak()
    return out


def describe_step(stats: dict) -> str:
    """One log line of a step's main figures."""
    def num(key, fmt):
        v = stats.get(key)
        return "-" if v is None else format(v, fmt)
    return (f"step {stats['step']}: loss {num('loss', '.4f')}, lr {num('lr', '.3g')}, grad norm "
            f"{num('grad_norm', '.3g')}, {num('step_time_s', '.3f')} s, {num('tokens_per_s', '.0f')} tokens/s, "
            f"skipped {stats['skipped_steps']}, model states {stats['model_state_bytes'] / 2**20:.1f} MiB, "
            f"cache peak {stats['cache_peak_bytes'] / 2**20:.1f} MiB")
