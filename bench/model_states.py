"""Model-state bytes per rank, measured, against ZeRO's Table 1, for stages 0-3 over several world sizes.

    python bench/model_states.py [--worlds 1,2,3] [--steps 2] [--json out.json]

Workload: gpt2-tiny (bench/step_time.py's make_model), bf16 compute with fp32 masters,
torch AdamW(lr=1e-3, weight_decay=0), 4 x 128 random tokens per rank per step. For each world size
the ranks are local processes over gloo (tests/distributed.py's spawn); each stage gets a fresh
model and trains --steps steps, after which every rank reports `engine.stats()["model_state_bytes"]`
(parameters, gradients, fp32 masters and Adam states it holds between steps) and the padded element
count Psi. Table 1 (mixed-precision Adam, K = 12) comes from zeroshard.planning.estimate with that Psi:
16 Psi, 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N bytes for stages 0-3.

The engine counts parameter and gradient buffers by their sizes, so each row also carries a check
that does not rely on it: the bytes of every tensor storage reachable from Python after the steps,
less those before the model was built ("live"). It sees everything the engine keeps (buffers
included) and misses what it releases between steps, such as a gradient shard freed after the update.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import warnings

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(here), os.path.join(os.path.dirname(here), "tests")]
from distributed import spawn  # noqa: E402

STAGES = (0, 1, 2, 3)
B, T, VOCAB = 4, 128, 512


def _device(world):
    """None (zeroshard's default: cuda:LOCAL_RANK) when every rank has a GPU, else the CPU."""
    return None if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of all tensors the garbage collector can reach (and their
    .grad, which autograd may have created without a Python object)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
                warnings.simplefilter("ignore")
                if not isinstance(obj, torch.Tensor):
                    continue
            tensors = [obj]
            try:
                if obj.grad is not None:
                    tensors.append(obj.grad)
            except Exception:  # a stage-3 placeholder refuses access outside its module's forward
                pass
            for t in tensors:
                if t.device.type != "meta":
                    st = t.untyped_storage()
                    storages[(t.device, st.data_ptr())] = max(storages.get((t.device, st.data_ptr()), 0), st.nbytes())
        except Exception:  # objects that pretend to be tensors (placeholders) and fail on inspection
            continue
    return sum(storages.values())


def measure(rank, world, path, steps):
    """Runs in each spawned rank: every stage in turn; rank 0 writes the per-rank figures to `path`."""
    import torch.distributed as dist
    import transformers

    import zeroshard
    from step_time import make_model
    transformers.logging.set_verbosity_error()
    rows = []
    for stage in STAGES:
        # Taken per stage: an earlier stage's engine may still be alive, and is then in both figures.
        before = live_tensor_bytes()
        engine = zeroshard.initialize(make_model(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0),
                                      config={"stage": stage, "precision": "bf16"}, device=_device(world))
        g = torch.Generator().manual_seed(1000 * stage + rank)
        for _ in range(steps):  # the batch is not kept past its step: it would count as "live"
            engine.backward(engine(input_ids=(x := torch.randint(0, VOCAB, (B, T), generator=g)), labels=x).loss)
            engine.step()
            del x
        s = engine.stats()
        mine = {"model_state_bytes": s["model_state_bytes"], "by_kind": s["model_state_bytes_by_kind"],
                "live": live_tensor_bytes() - before}
        every = [None] * world
        dist.all_gather_object(every, mine)
        rows.append({"stage": stage, "world": world, "padded_elements": s["padded_elements"],
                     "num_params": s["num_params"], "model_state_bytes_per_rank": [r["model_state_bytes"] for r in every],
                     "by_kind_per_rank": [r["by_kind"] for r in every],
                     "live_tensor_bytes_per_rank": [r["live"] for r in every]})
        del engine
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=2, help="steps before measuring (at least 1: optimizer states exist from the first)")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    from zeroshard.planning.estimate import estimate

    rows = []
    for world in (int(w) for w in args.worlds.split(",") if w.strip()):
        print(f"world {world} ...", flush=True)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.json")
            spawn(world, measure, path, args.steps)
            with open(path) as f:
                got = json.load(f)
        for r in got:
            psi = r["padded_elements"]
            r["measured_bytes"] = max(r["model_state_bytes_per_rank"])
            r["table1_bytes"] = estimate(psi, r["stage"], world, precision="bf16", optimizer="adam").device
            r["ratio"] = r["measured_bytes"] / r["table1_bytes"]
            r["live_bytes"] = max(r["live_tensor_bytes_per_rank"])
            rows.append(r)
            print(f"  stage {r['stage']}: {r['measured_bytes'] / 2**20:8.2f} MiB/rank (max), Table 1 "
                  f"{r['table1_bytes'] / 2**20:8.2f} MiB, ratio {r['ratio']:.4f}; live tensors {r['live_bytes'] / 2**20:8.2f} MiB; "
                  f"Psi {psi:,} "
                  f"(padding {psi / r['num_params'] - 1:.2%})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "gpt2-tiny", "precision": "bf16", "optimizer": "AdamW", "steps": args.steps,
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
