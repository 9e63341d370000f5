"""Where a step's time goes, phase by phase, with the ranks started together at each phase: forward,
backward and optimizer step medians of DDP and zeroshard stages, and how much of each zeroshard
forward was spent waiting for gathered (stage 3) or arriving (stages 1-2) chunks.

    torchrun --standalone --nproc_per_node 2 bench/phase_waits.py [--model gpt2-small-cpu] [--systems ddp,zs2,zs3] [--steps 20]

Unlike bench/step_time.py (steps back to back, as training runs them, so each collective also
absorbs how far the ranks drifted apart), a barrier precedes each forward: the phases show what
each system's own work costs, and "wait" what of the forward is exposed communication. Same
workloads, models, data and AdamW as step_time.py; rank 0 prints milliseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time as st  # noqa: E402
from zeroshard.runtime import chunks as chunk_module  # noqa: E402

_waited = [0.0]


def _timed(method):
    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            _waited[0] += time.perf_counter() - t
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small-cpu", choices=list(st.WORKLOADS))
    ap.add_argument("--systems", default="ddp,zs2,zs3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    # What a forward waits for: a stage-3 gather, or a stages 1-2 update still arriving.
    chunk_module.Chunk.finish_gather = _timed(chunk_module.Chunk.finish_gather)
    chunk_module.Chunk.await_arrival = _timed(chunk_module.Chunk.await_arrival)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    build = argparse.Namespace(model=args.model, cache_chunks=None, check_order=True, grad_norm=True, chunk_size=None)
    names = args.systems.split(",")
    systems = {n: st.build(n, build)[0] for n in names}
    data = st.make_data(args.model, args.steps, dist.get_world_size())
    got = {n: {"forward": [], "wait": [], "backward": [], "step": []} for n in names}
    for start in range(0, args.steps, 5):  # in turns of 5 steps, as step_time interleaves
        for n in names:
            phases = systems[n]
            for i in range(start, min(start + 5, args.steps)):
                dist.barrier()
                _waited[0] = 0.0
                t0 = time.perf_counter()
                loss = phases.forward(data[i, rank])
                t1 = time.perf_counter()
                wait = _waited[0]
                phases.backward(loss)
                t2 = time.perf_counter()
                phases.step()
                t3 = time.perf_counter()
                if i >= args.warmup:
                    for k, v in (("forward", t1 - t0), ("wait", wait), ("backward", t2 - t1), ("step", t3 - t2)):
                        got[n][k].append(v)
    if rank == 0:
        print(f"{args.model}, {dist.get_world_size()} ranks, medians of {args.steps - args.warmup} steps (ms), "
              "a barrier before each forward:")
        for n in names:
            print(f"  {n:5s} " + "  ".join(f"{k} {statistics.median(v) * 1e3:7.2f}" for k, v in got[n].items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
