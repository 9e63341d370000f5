"""Fingerprints of the trained parameters, to prove that a refactor changed no behaviour.

    python bench/bit_identity.py > before.txt     # on the old code
    python bench/bit_identity.py > after.txt      # on the new code; then: diff before.txt after.txt

Trains a set of configurations (stages 0-3; SGD+momentum and AdamW; plain, two micro-batches,
clipping; bf16 and fp16; every offload flag; the delayed update; the quirky model with and without
activation checkpointing) for a few steps at world sizes 1 and 2 (gloo, CPU), and prints one SHA-256
of each rank-0 full state dict's bytes and chunk layout (parameter names chunk by chunk), then one
digest over all. Any changed bit, or a parameter packed elsewhere, changes a line.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(here), os.path.join(os.path.dirname(here), "tests")]


def cases():
    import zeroshard
    from models import make_adamw, make_sgd
    out = {}
    for stage in range(4):
        for opt in (make_sgd, make_adamw):
            for mode, kw in (("plain", {}), ("accum2", {"gradient_accumulation_steps": 2}),
                             ("clip", {"clip_grad_norm": 0.5})):
                out[f"gpt2_{opt.__name__[5:]}_{mode}_stage{stage}"] = ("gpt2", opt, {"stage": stage, **kw})
        out[f"quirky_ckpt_stage{stage}"] = ("quirky", make_sgd, {"stage": stage, "cache_chunks": 1})
    for stage in (2, 3):
        out[f"bf16_cpuadamw_stage{stage}"] = ("gpt2", zeroshard.CPUAdamW, {"stage": stage, "precision": "bf16"})
    out["fp16_adamw_stage2"] = ("gpt2", make_adamw, {"stage": 2, "precision": "fp16", "initial_loss_scale": 2.0**14})
    offload = {"offload_optimizer": True, "offload_params": True, "offload_activations": True}
    out["offload_all_stage3"] = ("gpt2", make_adamw, {"stage": 3, "gradient_accumulation_steps": 2, **offload})
    out["offload_opt_stage1"] = ("gpt2", make_sgd, {"stage": 1, "offload_optimizer": True, "clip_grad_norm": 0.5})
    out["delayed_stage2"] = ("gpt2", make_adamw, {"stage": 2, "offload_optimizer": True, "delay_update_after": 1})
    return out


def run(rank, world, out_path):
    import torch
    import zeroshard
    from models import Quirky, batches, quirky_data, tiny_gpt2, train
    prints = {}
    for name, (model, opt, cfg) in cases().items():
        cfg = {"chunk_size": 20000 if model == "gpt2" else 600, **cfg}
        accumulation = cfg.get("gradient_accumulation_steps", 1)
        if model == "gpt2":
            engine = zeroshard.initialize(tiny_gpt2(), opt, cfg)
            train(engine, batches(3, world, 2, accumulation), rank)
        else:
            engine = zeroshard.initialize(Quirky(), opt, cfg)
            train(engine, quirky_data(3, world, accumulation), rank,
                  loss_fn=lambda m, x: m(x, checkpoint=True).pow(2).mean())
        sd = engine.full_state_dict()
        h = hashlib.sha256()
        h.update(repr([[s.name for s in c.slots] for c in engine.chunks]).encode())  # the chunk layout too
        for k in sorted(sd):
            h.update(k.encode())
            h.update(sd[k].contiguous().view(torch.uint8).numpy().tobytes())
        prints[name] = h.hexdigest()[:16]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(prints, f)


def main():
    from distributed import spawn
    total = hashlib.sha256()
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "prints.json")
            spawn(world, run, path)
            prints = json.load(open(path))
        for name, digest in prints.items():
            print(f"world{world} {name:28s} {digest}")
            total.update(f"{world}{name}{digest}".encode())
    print(f"all {total.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
