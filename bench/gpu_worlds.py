"""Time the multi-process test scenarios at world sizes > 1 on this machine (with CUDA: every rank
on the one GPU, over gloo through host memory), printing each rank's stacks if one stalls.

    python bench/gpu_worlds.py --world 2 --only gpt2_sgd_plain_stage0 gpt2_sgd_plain_stage3
    python bench/gpu_worlds.py --world 2 --prefix delayed_        # every scenario whose name starts so

Tells a slow run from a hung one: pytest-timeout shows only the parent's stack, waiting in spawn.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--prefix", default=None)
    ap.add_argument("--stacks", type=float, default=60.0, help="seconds between stack dumps of every rank")
    args = ap.parse_args()
    from distributed import spawn
    from scenarios import SCENARIOS, run_all
    names = [n for n in SCENARIOS if n in args.only or (args.prefix and n.startswith(args.prefix))]
    os.environ["ZEROSHARD_RANK_STACKS"] = str(args.stacks)
    out = os.path.join(tempfile.mkdtemp(), "results.json")
    t0 = time.perf_counter()
    spawn(args.world, run_all, out, names)
    took = time.perf_counter() - t0
    results = json.load(open(out))
    for name, r in results.items():
        shown = {k: v for k, v in r.items() if k in ("diff", "vs_exact", "error", "raised")}
        print(f"{name}: {shown}")
    print(f"world {args.world}: {len(names)} scenarios in {took:.1f} s")


if __name__ == "__main__":
    main()
