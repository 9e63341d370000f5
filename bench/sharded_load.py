"""Peak memory per rank while a pretrained GPT-2 is built and loaded for stage-3 training (issue 15).

    python bench/sharded_load.py [--n-layer 24] [--n-embd 1024] [--world 3] [--dir /tmp/zs-load] [--json F]

Default: GPT-2 medium's shape (24 x 1024, vocab 50257: 355M parameters, 1.42 GB in fp32), saved once
with transformers' save_pretrained (fp32, one file). Then, each in a fresh group of `world` CPU
processes (gloo), bf16, stage 3, AdamW (its states appear only at the first step, so not here):

- normal: `GPT2LMHeadModel(config)` built as usual on every rank, `zeroshard.initialize`, then
  `engine.load_weights(folder)` (what a user who builds the model normally does);
- meta + weights=: the model built on the meta device, `initialize(..., weights=folder)`;
- meta + load_weights: built on meta, `initialize` (the meta model initialised), then `load_weights`;
- from_pretrained: `GPT2LMHeadModel.from_pretrained(folder)` in one process, for its time.

Each rank measures its peak resident memory (VmHWM, reset through /proc/self/clear_refs) over
initialize + load, less its resident memory before, and what stays resident after (the model as
built must not: stage 3 frees it as the chunks take it); the goal is at most 0.6 x the model's fp32 bytes
for the meta path (its model states alone are 0.5 x at world 3: a bf16 shard and an fp32 master,
6 bytes per parameter over 3 ranks). Times are wall seconds of rank 0. Every path's parameters are
checked against the folder, bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from distributed import spawn  # noqa: E402


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS := current RSS
    return _status("VmRSS:")


def _config(args):
    from transformers import GPT2Config
    return GPT2Config(n_layer=args["n_layer"], n_embd=args["n_embd"], n_head=16, vocab_size=50257, n_positions=1024)


def _check(engine, folder) -> bool:
    """Parameters equal the folder's tensors, bit for bit (a tensor at a time, on rank 0)."""
    from safetensors import safe_open
    ok = True
    with engine.full_parameters(writeback=False):  # the chunks' fp32 masters in the parameters
        if engine.comm.rank == 0:
            params = dict(engine.module.named_parameters())
            with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
                ok = all(torch.equal(params[k], f.get_tensor(k)) for k in f.keys())
    return ok


def path_run(rank, world, args, how):
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel
    from transformers import logging as hf_logging

    import zeroshard
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    cfg = {"stage": 3, "precision": "bf16"}
    config = _config(args)
    base = _reset_peak()
    t0 = time.perf_counter()
    if how == "normal":
        engine = zeroshard.initialize(GPT2LMHeadModel(config), None, cfg, device="cpu")
        engine.load_weights(args["folder"])
    else:
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        if how == "meta_weights":
            engine = zeroshard.initialize(model, None, cfg, device="cpu", weights=args["folder"])
        else:
            engine = zeroshard.initialize(model, None, cfg, device="cpu")
            engine.load_weights(args["folder"])
    seconds = time.perf_counter() - t0
    peak, resident = _status("VmHWM:") - base, _status("VmRSS:") - base
    peaks, residents = [None] * world, [None] * world
    dist.all_gather_object(peaks, peak)
    dist.all_gather_object(residents, resident)
    ok = _check(engine, args["folder"])
    if rank == 0:
        with open(os.path.join(args["dir"], f"{how}.json"), "w") as f:
            json.dump({"peaks": peaks, "residents": residents, "seconds": seconds, "bitwise": ok}, f)


FROM_PRETRAINED = r"""
import json, sys, time, torch
from transformers import GPT2LMHeadModel
torch.set_num_threads(1)
t0 = time.perf_counter()
GPT2LMHeadModel.from_pretrained(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/zs-load-bench")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    args = {"n_layer": a.n_layer, "n_embd": a.n_embd, "dir": a.dir,
            "folder": os.path.join(a.dir, f"gpt2-{a.n_layer}x{a.n_embd}")}
    os.makedirs(a.dir, exist_ok=True)
    from transformers import GPT2LMHeadModel
    if not os.path.exists(os.path.join(args["folder"], "model.safetensors")):
        torch.manual_seed(0)
        GPT2LMHeadModel(_config(args)).save_pretrained(args["folder"])
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT2LMHeadModel(_config(args)).parameters())
    fp32 = 4 * n
    print(f"GPT-2 {a.n_layer} x {a.n_embd}, vocab 50257: {n / 1e6:.1f} M parameters, {fp32 / 1e9:.2f} GB in fp32; "
          f"world {a.world}, bf16, stage 3")
    rows = []
    for how, label in (("normal", "built normally + load_weights"), ("meta_weights", "meta + initialize(weights=)"),
                       ("meta_load", "meta + initialize + load_weights")):
        spawn(a.world, path_run, args, how)
        got = json.load(open(os.path.join(a.dir, f"{how}.json")))
        worst = max(got["peaks"])
        rows.append({"path": how, "label": label, "peak_bytes": got["peaks"], "of_fp32": worst / fp32,
                     "resident_bytes": got["residents"], "seconds": got["seconds"], "bitwise": got["bitwise"]})
        print(f"{label:36s} peak per rank {', '.join(f'{p / 1e6:,.0f}' for p in got['peaks'])} MB = "
              f"{worst / fp32:.2f} x fp32 model, resident after {max(got['residents']) / 1e6:,.0f} MB; "
              f"{got['seconds']:.1f} s; bit for bit: {got['bitwise']}")
    run = subprocess.run([sys.executable, "-c", FROM_PRETRAINED, args["folder"]], capture_output=True, text=True,
                         check=True)
    fp_seconds = json.loads(run.stdout.strip().splitlines()[-1])["seconds"]
    print(f"{'from_pretrained (one process)':36s} {fp_seconds:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"params": n, "fp32_bytes": fp32, "world": a.world, "n_layer": a.n_layer, "n_embd": a.n_embd,
                       "rows": rows, "from_pretrained_seconds": fp_seconds, "goal_of_fp32": 0.6}, f, indent=1)


if __name__ == "__main__":
    main()
