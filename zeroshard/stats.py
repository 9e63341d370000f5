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
the planner predicts), `loss_scale`, `grad_norm` (with clipping), `skipped_steps` (optimizer steps
skipped since the start for a non-finite gradient: fp16 overflow, config nonfinite='skip'), and
counts of parameters, chunks and padded elements.
"""
from __future__ import annotations


def model_state_bytes(chunks, optim) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of model states this rank keeps between steps, by kind ('params', 'grads', 'optimizer':
    fp32 masters and the optimizer's states) and by where ('device', 'host')."""
    opt_bytes = optim.state_bytes()
    by_kind = {"params": 0, "grads": 0, "optimizer": sum(opt_bytes.values())}
    by_device = {"device": opt_bytes[False], "host": opt_bytes[True]}
    for c in chunks:
        for kind, on_host, n in c.state_bytes():
            by_kind["optimizer" if kind == "master" else kind] += n
            by_device["host" if on_host else "device"] += n
    return by_kind, by_device


def step_stats(engine, applied: bool) -> dict:
    """The figures of the step just taken; restarts the counters they came from."""
    by_kind, by_device = model_state_bytes(engine.chunks, engine.optim)
    cache = engine.cache
    out = {
        "step": engine.steps,
        "applied": applied,
        "comm_elements": engine.comm.elements,
        "control_collectives": engine.comm.control_collectives,
        "order_checks": engine.comm.order_checks,
        "model_state_bytes": sum(by_kind.values()),
        "model_state_bytes_by_kind": by_kind,
        "model_state_bytes_by_device": by_device,
        "transfer_bytes": {"h2d": engine.transfer.h2d_bytes, "d2h": engine.transfer.d2h_bytes},
        "num_params": sum(s.numel() for s in engine.shapes.values()),
        "num_chunks": len(engine.chunks),
        "padded_elements": sum(c.padded_numel for c in engine.chunks),
        "cache_peak_chunks": cache.peak,
        "cache_peak_bytes": cache.peak_bytes,
        "cache_overflows": cache.overflows,
        "schedule_departures": cache.departures,
        "device_model_bytes": by_device["device"] + cache.peak_bytes,
        "loss_scale": engine.scaler.scale if engine.scaler else None,
        "grad_norm": engine.optim.last_grad_norm,
        "skipped_steps": engine.optim.skipped_steps,
        "world_size": engine.comm.world,
    }
    engine.comm.reset_counters()
    engine.transfer.reset_counters()
    cache.reset_peak()
    return out
