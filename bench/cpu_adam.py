"""CPU Adam throughput: zeroshard.CPUAdamW against torch's AdamW (for-loop, foreach, fused) and
DeepSpeedCPUAdam when it is installed, on one flat fp32 tensor, with the machine's memory bandwidth
measured in the same run so the figures read as a fraction of what memory allows.

    python bench/cpu_adam.py                 # 64M elements (the anchors' size)
    python bench/cpu_adam.py --numel 16M --json out.json

Bytes per element: an fp32 AdamW step reads param, grad, exp_avg, exp_avg_sq and writes param,
exp_avg, exp_avg_sq: 28 bytes; writing the bf16 copy that goes back to the device adds 2 (30).
Bandwidth: the fastest of three streams over two fp32 tensors of the same size (read: a.sum();
copy: a = b; update: a += b), counting only the bytes the program reads and writes.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from zeroshard.optim import cpu_adam
from zeroshard.optim.cpu_adam import CPUAdamW


def parse_numel(s: str) -> int:
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def best(fn, reps: int) -> float:
    fn()  # warm-up: allocates optimizer state, faults pages in
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=parse_numel, default=64 * 2**20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    n = args.numel
    torch.manual_seed(0)
    kernel = cpu_adam.kernel()  # compile (once per machine) before timing anything

    a, b = torch.randn(n), torch.randn(n)
    streams = {"read (a.sum())": 4 * n / best(lambda: a.sum(), args.reps),
               "copy (a = b)": 8 * n / best(lambda: a.copy_(b), args.reps),
               "update (a += b)": 12 * n / best(lambda: a.add_(b), args.reps)}
    bw = max(streams.values())
    del a, b

    g16 = torch.randn(n).bfloat16()

    def opt_case(make, copy=None, separate_copy=False, grad16=None):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = make([p])

        def step():
            if copy is not None and not separate_copy:
                opt.copy_targets[id(p)] = copy
            if grad16 == "widened":  # what the engine did before: fp32 copy of the gradient, scaled, then the step
                p.grad = g16.float().mul_(0.5)
            elif grad16 == "read":  # the kernel reads the 16-bit gradient and scales it in its pass
                opt.grad_inputs[id(p)] = (g16, 0.5, 1.0)
            opt.step()
            if separate_copy:
                copy.copy_(p.detach())
        return step

    out16 = torch.empty(n, dtype=torch.bfloat16)
    cases = [
        ("torch AdamW (for-loop)", lambda ps: torch.optim.AdamW(ps, foreach=False), None, False, 28, None),
        ("torch AdamW (foreach)", lambda ps: torch.optim.AdamW(ps, foreach=True), None, False, 28, None),
        ("torch AdamW (fused)", lambda ps: torch.optim.AdamW(ps, fused=True), None, False, 28, None),
        ("torch AdamW (fused) + bf16 copy", lambda ps: torch.optim.AdamW(ps, fused=True), out16, True, 30, None),
        ("zeroshard CPUAdamW", CPUAdamW, None, False, 28, None),
        ("zeroshard CPUAdamW + bf16 copy", CPUAdamW, out16, False, 30, None),
        # a bf16 gradient scaled by 1/(world x accumulation): 6 + 8 bytes more when widened first
        ("bf16 grad widened, CPUAdamW + copy", CPUAdamW, out16, False, 44, "widened"),
        ("bf16 grad read by CPUAdamW + copy", CPUAdamW, out16, False, 28, "read"),
    ]
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        cases.append(("DeepSpeedCPUAdam", lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True), None, False, 28, None))
    except Exception as e:  # not a dependency: measured only where it is installed
        print(f"(DeepSpeedCPUAdam not measured: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

    print(f"{n / 2**20:.0f}M fp32 elements, {torch.get_num_threads()} threads, "
          f"CPUAdamW kernel: {'compiled' if kernel is not None else 'unavailable (torch fused fallback)'}")
    print("memory bandwidth, best of %d: %s -> using %.1f GB/s" % (
        args.reps, ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in streams.items()), bw / 1e9))
    print(f"{'implementation':34} {'time':>9} {'G elem/s':>9} {'GB/s':>7} {'of bw':>6}")
    rows = []
    for name, make, copy, separate, bytes_per, grad16 in cases:
        t = best(opt_case(make, copy, separate, grad16), args.reps)
        rows.append({"name": name, "seconds": t, "elements_per_s": n / t, "bytes_per_element": bytes_per,
                     "gb_per_s": bytes_per * n / t / 1e9, "fraction_of_bandwidth": bytes_per * n / t / bw})
        r = rows[-1]
        print(f"{name:34} {t * 1e3:7.1f}ms {r['elements_per_s'] / 1e9:9.2f} {r['gb_per_s']:7.1f} "
              f"{r['fraction_of_bandwidth']:6.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": n, "threads": torch.get_num_threads(), "bandwidth_bytes_per_s": bw,
                       "streams_bytes_per_s": streams,
                       "kernel": kernel is not None, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
