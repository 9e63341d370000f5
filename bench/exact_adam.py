"""The exact Adam kernel (zeroshard/optim/exact_adam.py) against torch's own AdamW step on the CPU:
bits and time over the same elements.

    python bench/exact_adam.py [--elements 23240704] [--steps 6] [--threads N]

Steps one fp32 tensor of --elements (default: gpt2-small-cpu's parameter count) three ways from the
same start and gradients (three scales, some exactly 0): torch.optim.AdamW over the tensor as tiles
of tiled_step.TILE elements (what zeroshard's tiled step hands torch), torch.optim.AdamW over it as
one tensor (what DDP steps, per parameter), and the kernel over it as one tensor, as the tiled step
calls it for a span. Prints, per step, whether the kernel's parameter and both moments equal torch's
bit for bit, then each way's median time, for weight decay 0.01 and 0 (the kernel skips the
multiply there, as torch does).

Its predecessor, a probe with its own copy of the kernel, found the rules the kernel follows (2026-12-01):
every operation as ATen computes it, and the sqrt MKL's vmsSqrt as torch's is; with the correctly
rounded vector sqrt instead, 435 of 23.2M parameters differed after one step.
"""
import argparse
import statistics
import sys
import time

import torch

from zeroshard.optim import exact_adam, tiled_step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=23240704, help="a multiple of 64")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.elements % 64:
        ap.error("--elements must be a multiple of 64")
    if exact_adam.ops() is None:
        print("the exact Adam kernel cannot be built here (see the log line above)")
        return 1
    n, equal_everywhere = args.elements, True
    print(f"{n} fp32 elements, {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for wd in (0.01, 0.0):
        gen = torch.Generator().manual_seed(0)
        start = torch.randn(n, generator=gen)
        whole = torch.nn.Parameter(start.clone())
        tiled = torch.nn.Parameter(start.clone())
        tiles = [torch.nn.Parameter(t) for t in tiled.detach().split(tiled_step.TILE)]
        hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
        opt_whole, opt_tiles = torch.optim.AdamW([whole], **hyper), torch.optim.AdamW(tiles, **hyper)
        group = opt_whole.param_groups[0]
        mine, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
        times = {"torch AdamW, tiles": [], "torch AdamW, one tensor": [], "exact kernel": []}
        for k in range(1, args.steps + 1):
            g = torch.randn(n, generator=gen) * 10.0 ** (k % 3 - 1)
            g[::11] = 0
            whole.grad = g
            for t, gt in zip(tiles, g.split(tiled_step.TILE)):
                t.grad = gt
            for name, fn in (("torch AdamW, tiles", opt_tiles.step), ("torch AdamW, one tensor", opt_whole.step),
                             ("exact kernel", lambda: exact_adam.step_(mine, g, m, v, group, float(k)))):
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn()
                times[name].append(time.perf_counter() - t0)
            st = opt_whole.state[whole]
            same = (torch.equal(mine, whole.detach()), torch.equal(m, st["exp_avg"]), torch.equal(v, st["exp_avg_sq"]),
                    torch.equal(tiled.detach(), whole.detach()))
            equal_everywhere &= all(same)
            print(f"weight_decay {wd}, step {k}: kernel == torch: parameter {same[0]} "
                  f"({int((mine != whole.detach()).sum())} differ), exp_avg {same[1]}, exp_avg_sq {same[2]}; "
                  f"tiles == one tensor {same[3]}")
        print(f"weight_decay {wd}, median of steps 2-{args.steps}: " +
              ", ".join(f"{name} {statistics.median(ts[1:]) * 1e3:.1f} ms" for name, ts in times.items()))
    print("every step bit-equal:", equal_everywhere)
    return 0 if equal_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
