"""Checkpoint figures for GPT-2 (124M by default): save at world 2 / stage 3, load at world 3 / stage 1
and world 1 / stage 0, export to safetensors with the export's peak memory against the bound
(1.5 x the largest shard + the largest tensor).

    python bench/checkpoint.py [--n-layer 12] [--n-embd 768] [--vocab 50257] [--dir /tmp/zs-ckpt]

CPU processes over gloo (spawned here); on a machine with CUDA the ranks use GPUs only if there are
enough of them, else the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from distributed import spawn  # noqa: E402


def _model(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=args["n_layer"], n_embd=args["n_embd"], n_head=12,
                                      vocab_size=args["vocab"], n_positions=128))


def _device(world):
    """None (zeroshard's default: cuda:LOCAL_RANK) when every rank has a GPU, else the CPU."""
    return None if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"


def _step(engine, rank, vocab):
    x = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()


def save_phase(rank, world, args):
    import torch.distributed as dist

    import zeroshard
    engine = zeroshard.initialize(_model(args), None, {"stage": 3, "precision": "bf16"},
                                  device=_device(world))
    _step(engine, rank, args["vocab"])
    dist.barrier()
    t0 = time.perf_counter()
    path = engine.save_checkpoint(args["root"])
    seconds = time.perf_counter() - t0
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, os.path.join(args["dir"], "full.pt"))
        with open(os.path.join(args["dir"], "save.json"), "w") as f:
            json.dump({"seconds": seconds, "path": path}, f)


def load_phase(rank, world, args, stage):
    import torch.distributed as dist

    import zeroshard
    engine = zeroshard.initialize(_model(args), None, {"stage": stage, "precision": "bf16"},
                                  device=_device(world))
    dist.barrier()
    t0 = time.perf_counter()
    engine.load_checkpoint(args["root"])
    seconds = time.perf_counter() - t0
    got = engine.full_state_dict()
    _step(engine, rank, args["vocab"])  # and it trains on
    if rank == 0:
        want = torch.load(os.path.join(args["dir"], "full.pt"))
        with open(os.path.join(args["dir"], f"load{world}.json"), "w") as f:
            json.dump({"seconds": seconds, "bitwise": all(torch.equal(got[k], want[k]) for k in want)}, f)


PEAK = r"""
import sys, torch, zeroshard.state.export as ex
from safetensors import safe_open
import torch.distributed.checkpoint

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # peak RSS := current RSS
base = status("VmRSS:")
t0 = __import__("time").perf_counter()
ex.export(sys.argv[1], sys.argv[2], progress=lambda line: None)
print(__import__("json").dumps({"peak": status("VmHWM:") - base, "seconds": __import__("time").perf_counter() - t0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dir", default="/tmp/zs-ckpt-bench")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    args = {"n_layer": a.n_layer, "n_embd": a.n_embd, "vocab": a.vocab, "dir": a.dir,
            "root": os.path.join(a.dir, "root")}
    n = sum(p.numel() for p in _model(args).parameters())
    print(f"GPT-2 {a.n_layer} layers x {a.n_embd}, vocab {a.vocab}: {n / 1e6:.1f} M parameters; bf16 compute, "
          "fp32 masters, AdamW")

    spawn(2, save_phase, args)
    saved = json.load(open(os.path.join(a.dir, "save.json")))
    files = {f: os.path.getsize(os.path.join(saved["path"], f)) for f in os.listdir(saved["path"])}
    shards = [v for f, v in files.items() if f.endswith(".distcp")]
    print(f"save   world 2 stage 3: {saved['seconds']:.2f} s, {sum(files.values()) / 1e6:,.1f} MB in {len(files)} files "
          f"({len(shards)} shards, largest {max(shards) / 1e6:,.1f} MB)")
    for world, stage in ((3, 1), (1, 0)):
        spawn(world, load_phase, args, stage)
        got = json.load(open(os.path.join(a.dir, f"load{world}.json")))
        print(f"load   world {world} stage {stage}: {got['seconds']:.2f} s, parameters bit for bit: {got['bitwise']}")

    out = os.path.join(a.dir, "export")
    run = subprocess.run([sys.executable, "-c", PEAK, args["root"], out], capture_output=True, text=True, check=True)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    want = torch.load(os.path.join(a.dir, "full.pt"))
    largest_tensor = max(t.numel() * t.element_size() for t in want.values())
    bound = 1.5 * max(shards) + largest_tensor
    from safetensors.torch import load_file
    exported = load_file(os.path.join(out, "model.safetensors"))
    model = _model(args)
    model.load_state_dict(exported, strict=True)
    same = list(exported) == list(want) and all(torch.equal(exported[k], want[k]) for k in want)
    print(f"export {os.path.getsize(os.path.join(out, 'model.safetensors')) / 1e6:,.1f} MB in {got['seconds']:.2f} s; "
          f"peak memory {got['peak'] / 1e6:,.1f} MB, bound {bound / 1e6:,.1f} MB (1.5 x {max(shards) / 1e6:,.1f} + "
          f"{largest_tensor / 1e6:,.1f}); load_state_dict(strict=True) ok; equals full_state_dict(): {same}")


if __name__ == "__main__":
    main()
