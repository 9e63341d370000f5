"""DeepSpeed ZeRO stages 1-3 as systems of bench/step_time.py ("ds1", "ds2", "ds3"), CPU.

    torchrun --standalone --nproc_per_node 2 bench/step_time.py --systems ddp,zs1,zs2,zs3,ds1,ds2,ds3 [...]
    torchrun --standalone --nproc_per_node 2 bench/deepspeed_step.py [...]   # the same, --systems ddp,ds1,ds2,ds3

Run it with a Python that has deepspeed, e.g. a side virtual environment (DeepSpeed is a peer we measure
against, never a dependency of zeroshard, so it is not in the project's environment):

    python3 -m venv /opt/ds-venv
    /opt/ds-venv/bin/pip install torch==2.13.0                    # the CPU build, first, so nothing else pulls one
    /opt/ds-venv/bin/pip install transformers deepspeed==0.19.8
    /opt/ds-venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 bench/step_time.py ...

or the project's python with DeepSpeed and its pure-Python dependencies in side folders put on PYTHONPATH
by a two-line wrapper (bench/run_all.py's docstring shows one; ZEROSHARD_DEEPSPEED_PYTHON names it there).

DS_ACCELERATOR=cpu is set (unless already set) before deepspeed is imported, so a plain torchrun launch
works. The figures in shared/notes/anchors.md were taken with DeepSpeed's own launcher; only torchrun is
tried here. DeepSpeed adopts step_time.py's gloo process group, one thread per rank.

Each stage: a fresh model from step_time.make_model, torch.optim.AdamW(lr=1e-3, weight_decay=0) handed to
deepspeed.initialize as a client optimizer (not DeepSpeed's fused or CPU Adam, so every system runs the
same optimizer; hence "zero_allow_untested_optimizer"); fp32 (no fp16/bf16 section), no gradient
clipping, DeepSpeed's default bucket sizes and overlap settings. A step is forward, engine.backward(loss),
engine.step() (DeepSpeed's optimizer step, gradients zeroed included), timed by step_time.py's loop
among the other systems, so DeepSpeed's ratios to DDP are taken in the same sitting as zeroshard's.
"""
from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the deepspeed import: it picks the accelerator then

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import WORKLOADS, Phases, make_model  # noqa: E402


def import_deepspeed():
    """Import deepspeed quietly (its logger at WARNING, torch 2.13's deprecation warnings for the
    collectives it calls silenced) and return the module."""
    import logging

    import deepspeed
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning)
    return deepspeed


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
    deepspeed = import_deepspeed()
    model = make_model(workload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(stage, dist.get_world_size(), WORKLOADS[workload]["B"]))
    return Phases(lambda x: engine(input_ids=x, labels=x, use_cache=False).loss, engine.backward, engine.step), engine


if __name__ == "__main__":
    if not any(a == "--systems" or a.startswith("--systems=") for a in sys.argv[1:]):
        sys.argv[1:1] = ["--systems", "ddp,ds1,ds2,ds3"]
    import step_time
    step_time.main()
