"""Step time of DeepSpeed ZeRO stages 1-3 on a workload of bench/step_time.py (--model), CPU.

    torchrun --standalone --nproc_per_node 2 bench/deepspeed_step.py [--model gpt2-tiny] [--steps 20] [--warmup 3]
        [--json out.json] [--stages 1,2,3] [--phase-sync]

Run it with a Python that has deepspeed, e.g. a side virtual environment (DeepSpeed is a peer we measure
against, never a dependency of zeroshard, so it is not in the project's environment):

    python3 -m venv /opt/ds-venv
    /opt/ds-venv/bin/pip install torch==2.13.0                    # the CPU build, first, so nothing else pulls one
    /opt/ds-venv/bin/pip install transformers deepspeed==0.19.8
    /opt/ds-venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 bench/deepspeed_step.py

or the project's python with DeepSpeed and its pure-Python dependencies in side folders put on PYTHONPATH
by a two-line wrapper (bench/run_all.py's docstring shows one; ZEROSHARD_DEEPSPEED_PYTHON names it there).

The script sets DS_ACCELERATOR=cpu itself (unless already set) before importing deepspeed, so a plain
torchrun launch works. The figures in shared/notes/anchors.md were taken with DeepSpeed's own launcher
(`deepspeed --num_gpus 2 bench/deepspeed_step.py` should run this script the same way; only torchrun is tried). The process group is DeepSpeed's choice
for the CPU accelerator (gloo, or ccl where oneCCL is installed), one thread per rank.

Workload "gpt2-tiny", exactly as in bench/step_time.py: GPT-2 with 4 layers, n_embd 256, 4 heads, vocab
512, 128 positions, no dropout (seed 0); torch.optim.AdamW(lr=1e-3, weight_decay=0), handed to
deepspeed.initialize as a client optimizer (not DeepSpeed's fused or CPU Adam, so every system runs the
same optimizer; hence "zero_allow_untested_optimizer"); fp32 (no fp16/bf16 section), no gradient
clipping, DeepSpeed's default bucket sizes and overlap settings; 4 x 128 tokens per rank per step. Each
stage gets a fresh model (ZeRO-3 partitions it in deepspeed.initialize) and runs --steps steps on the same
data; the first --warmup are not timed. A step is forward + engine.backward + engine.step, timed with
perf_counter after a barrier so ranks start together; the step's time is the slowest rank's, and the table
shows the median over timed steps, and per phase (forward: the engine call producing the loss; backward:
engine.backward(loss); step: engine.step()) the median of the slowest rank's phase times: the loop,
phases and JSON fields ("phases_s") are step_time.py's own (timed_steps, timing_row). On gpt2-tiny the
first three global-mean losses should match the reference 6.294075, 6.306614, 6.290297 (a stage more than
1e-4 off is flagged MISMATCH); --model gpt2-small-cpu (step_time.py's WORKLOADS) has no fixed reference:
compare with step_time.py's losses. A stage that fails is
recorded in the JSON with its "error" and the others still run. torch DDP runs first in the same
launch (row "ddp"), so each stage's ratio to DDP is taken in one sitting: a shared machine's speed
drifts between launches by more than the differences measured here.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import traceback
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the deepspeed import: it picks the accelerator then

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The workload, its data and the timing loop are step_time.py's own, so both tables measure the same thing.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import (PHASE_COLUMNS, PHASE_NOTE, WORKLOADS, Phases, check_timing, make_data,  # noqa: E402
                       make_model, phase_cells, timed_steps, timing_arguments, timing_row)
from step_time import build as build_torch_system  # noqa: E402

ALL_STAGES = [1, 2, 3]


def ds_config(stage, world, batch):
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch * world,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch.optim.AdamW, the optimizer every system runs
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build(stage, workload):
    """Return (Phases, engine) for one ZeRO stage on a fresh model."""
    import deepspeed
    model = make_model(workload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(stage, dist.get_world_size(), WORKLOADS[workload]["B"]))
    # engine.step() is DeepSpeed's optimizer step, gradients zeroed included.
    return Phases(lambda x: engine(input_ids=x, labels=x).loss, engine.backward, engine.step), engine


def run(stage, args, data):
    rank, world = dist.get_rank(), dist.get_world_size()
    name = f"ds{stage}"
    phases, engine = build(stage, args.model)
    row = timing_row(name, *timed_steps(phases, data, args))
    if hasattr(engine, "destroy"):
        engine.destroy()
    del phases, engine
    gc.collect()
    return row


def print_table(rows, machine, args):
    print(f"\nmachine: {machine['cores']} cores, torch {machine['torch']}, transformers {machine['transformers']}, "
          f"deepspeed {machine['deepspeed']} ({machine['accelerator']}), {machine['world']} ranks "
          f"({machine['backend']}), {machine['threads']} thread/rank")
    ref = WORKLOADS[args.model]["reference_losses"]
    print(f"{args.model}, {args.steps} steps ({args.warmup} warmup), fp32, torch AdamW; reference losses "
          + (", ".join(f"{v:.6f}" for v in ref) if ref else "not fixed: compare with step_time.py's") + "\n")
    print(PHASE_NOTE + (", torch.cuda.synchronize() at each boundary" if args.phase_sync else "") + "\n")
    ddp = rows[0]["median_s"]
    print(f"{'system':<7} {'median s':>9} {'vs DDP':>7} {PHASE_COLUMNS}  {'first three global losses':<29}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<7} {'-':>9}  ERROR: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            continue
        losses = " ".join(f"{v:.6f}" for v in r["losses"])
        flag = "  MISMATCH" if r.get("mismatch") else ""
        print(f"{r['system']:<7} {r['median_s']:>9.4f} {r['median_s'] / ddp:>6.2f}x {phase_cells(r)}  {losses:<29}{flag}")
    if args.model == "gpt2-tiny":
        print("\nanchors (DeepSpeed launcher, vs DDP 0.178 s): ZeRO-1 0.232 s 1.30x, ZeRO-2 0.201 s 1.13x, "
              "ZeRO-3 0.265 s 1.49x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    timing_arguments(ap)
    ap.add_argument("--stages", default="1,2,3", help="comma-separated subset of 1,2,3")
    args = ap.parse_args()
    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--stages takes numbers from {ALL_STAGES}")
    if sorted(set(stages) - set(ALL_STAGES)):
        ap.error(f"unknown stage(s) {sorted(set(stages) - set(ALL_STAGES))}; choose from {ALL_STAGES}")
    check_timing(ap, args)

    import deepspeed
    import transformers
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as ds_logger
    import logging
    ds_logger.setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    # DeepSpeed calls torch.distributed collectives that torch 2.13 marks deprecated, once per call.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning)
    torch.set_num_threads(1)  # 2 cores shared by 2 ranks: more threads would only oversubscribe
    if not dist.is_initialized():
        try:
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False,
                                       timeout=datetime.timedelta(minutes=10))
        except Exception as e:  # fall back to a plain gloo group, which deepspeed.initialize then adopts
            print(f"deepspeed.init_distributed failed ({e!r}); using torch.distributed gloo", flush=True)
            dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(args.model, args.steps, world)

    phases, _ = build_torch_system("ddp", args)
    rows = [timing_row("ddp", *timed_steps(phases, data, args))]
    del phases
    for stage in stages:
        if rank == 0:
            print(f"running ds{stage} ...", flush=True)
        try:
            rows.append(run(stage, args, data))
        except Exception:
            # A failure that hits one rank only leaves the other waiting in a collective until the timeout;
            # a configuration DeepSpeed rejects fails on every rank alike, and the run goes on.
            err = traceback.format_exc()
            print(f"[rank {rank}] ds{stage} failed:\n{err}", flush=True)
            rows.append({"system": f"ds{stage}", "error": err.strip()})
            gc.collect()

    for r in rows:
        if "error" not in r:
            ref = WORKLOADS[args.model]["reference_losses"]
            r["mismatch"] = ref is not None and any(abs(a - b) > 1e-4 for a, b in zip(r["losses"], ref))
    machine = {"cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
               "deepspeed": deepspeed.__version__, "accelerator": get_accelerator().device_name(),
               "backend": dist.get_backend(), "world": world, "threads": torch.get_num_threads(),
               "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "deepspeed or other"}
    if rank == 0:
        print_table(rows, machine, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workload": args.model, "machine": machine, "deepspeed": deepspeed.__version__,
                           "steps": args.steps, "warmup": args.warmup, "phase_sync": args.phase_sync,
                           "reference_losses": WORKLOADS[args.model]["reference_losses"],
                           "systems": rows}, f, indent=2)
            print(f"wrote {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
