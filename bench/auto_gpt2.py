"""offload="auto" against the four classic ZeRO configurations, in one run, on one device.

    python bench/auto_gpt2.py                                  # on a GPU: a GPT-2 too large without offload
    python bench/auto_gpt2.py --n-layer 2 --n-embd 128 --batch 2 --seq 64 --device-memory 40MB   # CPU smoke

Model and data as bench/offload_gpt2.py (GPT-2 built on the meta device, bf16, N(0, 0.02) weights,
activation checkpointing, random tokens; by default on CUDA n_embd 4096 and the fewest layers whose
16 bytes/parameter exceed the device). Each configuration trains `--warmup` + `--steps` steps with
CPUAdamW (lr 1e-4) where the optimizer is offloaded, torch AdamW (fused on CUDA) where it is not:
ZeRO-2, ZeRO-3 (rCache of 4 chunks), ZeRO-2 offload, ZeRO-3 offload (parameters too), and
offload="auto" (stage "auto"); and, apart from the comparison (it is not exact), ZeRO-2 offload with
the delayed parameter update. A configuration that runs out of memory is reported as such.

Printed: per configuration, median step time, model TFLOPS ((6 params + 12 layers n_embd seq) x
tokens / step time; checkpointing's recomputation not counted, as Elixir and ZeRO-Offload count),
peak device memory; then auto's speed-up over the best of the four.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroshard  # noqa: E402
from offload_gpt2 import (VOCAB, build, build_device, comparison_arguments, comparison_model,  # noqa: E402
                          gpt2_params, timed_steps)


CONFIGS = {
    "ZeRO-2": {"stage": 2},
    "ZeRO-3": {"stage": 3, "cache_chunks": 4},
    "ZeRO-2 offload": {"stage": 2, "offload_optimizer": True},
    "ZeRO-3 offload": {"stage": 3, "offload_optimizer": True, "offload_params": True, "cache_chunks": 4},
    "auto": {"stage": "auto", "offload": "auto"},
    # Not exact (each gradient is taken one update late), so not one of the four auto is compared with.
    "ZeRO-2 offload, delayed update": {"stage": 2, "offload_optimizer": True, "delay_update_after": 1},
}


def run(name, extra, args, n_layer, d, seq, cuda):
    model = build(n_layer, d, seq, build_device(gpt2_params(n_layer, d, seq), cuda))
    x0 = torch.randint(0, VOCAB, (args.batch, seq))
    cfg = {"precision": "bf16", **extra}
    if args.device_memory:
        cfg["device_memory"] = args.device_memory
    if name == "auto" or extra.get("offload_optimizer"):
        opt = lambda ps: zeroshard.CPUAdamW(ps, lr=1e-4)  # noqa: E731
    else:
        opt = lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=cuda)  # noqa: E731
    t0 = time.perf_counter()
    engine = zeroshard.initialize(model, opt, cfg, example_inputs={"input_ids": x0, "labels": x0}
                                  if name == "auto" else None)
    setup = time.perf_counter() - t0
    plan = engine.plan.describe() if engine.plan is not None else None
    if plan:
        print(f"  {plan}")
    times, _ = timed_steps(engine, args, seq, cuda)
    out = {"step_s": statistics.median(times), "setup_s": setup, "plan": plan,
           "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "device_model_bytes": engine.stats()["device_model_bytes"]}
    del engine, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    comparison_arguments(ap)
    ap.add_argument("--only", nargs="*", default=list(CONFIGS))
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    n_layer, d, seq, psi, dev_mem = comparison_model(args, cuda)
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"{device}: GPT-2 {n_layer} x {d}, {psi / 1e9:.2f} B parameters, batch {args.batch} x {seq}; "
          f"16 bytes/param = {16 * psi / 2**30:.1f} GiB" + (f", device {dev_mem / 2**30:.1f} GiB" if cuda else ""))
    flops_per_step = (6 * psi + 12 * n_layer * d * seq) * args.batch * seq
    rows = {}
    for name in args.only:
        print(f"{name} ...", flush=True)
        try:
            r = run(name, CONFIGS[name], args, n_layer, d, seq, cuda)
            r["tflops"] = flops_per_step / r["step_s"] / 1e12
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if "out of memory" not in str(e) and "nothing fits" not in str(e):
                raise
            r = {"error": str(e).splitlines()[0][:200]}
        rows[name] = r
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("\n| config | step s | model TFLOPS | peak device GiB |\n|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | - | - | {r['error']} |")
        else:
            peak = f"{r['peak_device_bytes'] / 2**30:.1f}" if r["peak_device_bytes"] else "-"
            print(f"| {name} | {r['step_s']:.3f} | {r['tflops']:.2f} | {peak} |")
    base = [r["tflops"] for n, r in rows.items() if n in list(CONFIGS)[:4] and "tflops" in r]
    if "auto" in rows and "tflops" in rows["auto"] and base:
        print(f"\nauto: {rows['auto']['tflops']:.2f} TFLOPS = {rows['auto']['tflops'] / max(base):.2f}x the best "
              f"of the four ZeRO configurations ({max(base):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "params": psi, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
