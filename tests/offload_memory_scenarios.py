"""Where the model states live with offload, part of scenarios.SCENARIOS: each rank's bytes by
device under each offload setting, and offload="auto" (Elixir) planning within a device-memory cap.
"""
from __future__ import annotations

import zeroshard
from models import batches, make_adamw, make_sgd, max_diff, reference, tiny_gpt2, train

SCENARIOS = {}


def offload_memory_bf16_adamw(rank, world):
    """Per-rank model-state bytes by device with offload, bf16 + AdamW (one micro-batch per step)."""
    out = {}
    data = batches(2, world, 2)
    for name, cfg in (("s1_opt", {"stage": 1, "offload_optimizer": True}),
                      ("s2_opt", {"stage": 2, "offload_optimizer": True}),
                      ("s3_opt", {"stage": 3, "offload_optimizer": True}),
                      ("s3_params", {"stage": 3, "offload_params": True}),
                      ("s3_all", {"stage": 3, "offload_optimizer": True, "offload_params": True,
                                  "cache_chunks": 2})):
        engine = zeroshard.initialize(tiny_gpt2(), zeroshard.CPUAdamW,
                                      {"precision": "bf16", "chunk_size": 20000, **cfg})
        train(engine, data[:-1], rank)
        gathered = []  # shard bytes of every gather in the last step
        for c in engine.chunks:
            def spy(comm, compare=True, c=c, real=c.start_gather):
                gathered.append(c.shard_numel * 2)
                real(comm, compare)
            c.start_gather = spy
        train(engine, data[-1:], rank)
        s = engine.stats()
        s["shard_bytes"] = sum(c.shard_numel * 2 for c in engine.chunks)
        s["trainable_shard_bytes"] = sum(c.shard_numel * 2 for c in engine.chunks if c.trainable)
        s["gathered_shard_bytes"] = sum(gathered)
        s["gathers"] = len(gathered)
        s["num_chunks"] = len(engine.chunks)
        out[name] = s
    return out


SCENARIOS["offload_memory_bf16_adamw"] = offload_memory_bf16_adamw


# -- Elixir: offload="auto" -----------------------------------------------------------------------
AUTO_CASES = {  # name: (precision, optimizer factory)
    "fp32_sgd": ("fp32", make_sgd),
    "fp32_adamw": ("fp32", make_adamw),
    "bf16_cpuadamw": ("bf16", zeroshard.CPUAdamW),
}


def _auto_caps(world, prec, opt, example):
    """Device memory caps for the planner: generous (1 TiB) and tight (between what ZeRO-3 and
    ZeRO-3 offload need on the chunks the planner picks at that cap)."""
    from zeroshard.planning.auto_plan import optimizer_state_bytes
    from zeroshard.distributed.collectives import default_device
    from zeroshard.planning.hardware import probe
    from zeroshard.planning.planner import FRAGMENTATION, Planner, Target

    prof = zeroshard.profile(tiny_gpt2(), example, dtype=prec)
    hw = probe(default_device())  # the engine plans for its own device (on CUDA: with the driver reserve)

    def planner(cap):
        return Planner(prof, Target(hw.with_(device_memory=cap), world=world, accumulation=2,
                                    optimizer_state_bytes=optimizer_state_bytes(opt)))
    base = {b.name: b.device_bytes for b in planner(1 << 40).baselines()}
    tight = int((base["ZeRO-3"] + base["ZeRO-3 offload"]) / 2 / FRAGMENTATION)
    zero3_need = {b.name: b.device_bytes for b in planner(tight).baselines()}["ZeRO-3"] / FRAGMENTATION
    return {"generous": 1 << 40, "tight": tight}, zero3_need


def _add_auto():
    for case, (prec, opt) in AUTO_CASES.items():
        def fn(rank, world, prec=prec, opt=opt):
            data = batches(3, world, 2, accumulation=2)
            ref, _, _ = reference(tiny_gpt2(), data, opt)
            x = data[0, 0, rank]
            example = {"input_ids": x, "labels": x}
            caps, zero3_need = _auto_caps(world, prec, opt, example)
            out = {"zero3_need": zero3_need}
            for name, cap in caps.items():
                cfg = {"stage": "auto", "offload": "auto", "precision": prec, "device_memory": cap,
                       "gradient_accumulation_steps": 2}
                engine = zeroshard.initialize(tiny_gpt2(), opt, cfg, example_inputs=example)
                train(engine, data, rank)
                plan = engine.plan
                out[name] = {"diff": max_diff(engine.full_state_dict(), ref), "cap": cap, **engine.stats(),
                             "plan": plan.describe(), "plan_stage": plan.stage, "plan_fits": plan.fits,
                             "offloaded_chunks": plan.offloaded_chunks,
                             "predicted_device_model_bytes": plan.device_model_bytes,
                             "predicted_device_bytes": plan.device_bytes}
            return out
        SCENARIOS[f"auto_{case}"] = fn


_add_auto()
