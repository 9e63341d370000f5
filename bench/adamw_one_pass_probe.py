"""Probe (issue 34, not used by zeroshard): can one pass over memory give the bits of torch's
single-tensor AdamW on the CPU, which DDP and zeroshard's tiled step both run (seven passes)?

    python bench/adamw_one_pass_probe.py [--elements 4194304]

Builds a small C++ kernel (torch's extension builder, ATen's Vectorized<float>) that applies, per
element, the operations of torch.optim.adam._single_tensor_adam as ATen's CPU kernels compute them
(found one by one on an AVX-512 Xeon, torch 2.13: lerp_ is fmadd(w, end - self, self); addcmul_ is
fmadd(value * t1, t2, self); a tensor divided by a Python float divides by that float in fp32;
addcdiv_ is self + (value * t1) / t2), then steps both for a few steps on random data and prints
whether parameter, exp_avg and exp_avg_sq are bit-equal, and each step's time. Finding (2026-12-01):
the moments are bit-equal, the parameter is not (91 of 4.2M elements after one step, 457 after
six, by an ulp or so): torch's fp32 sqrt here is not the correctly rounded one that _mm512_sqrt_ps
gives (the script checks that too; which call torch makes, MKL's vector math where torch is built
with it, is not yet checked). The kernel took 5.8-6.2 ms against torch's 31.6-42.1 ms on 4.2M
elements, one thread. A kernel for real would take its sqrt from the call torch makes, block by
block in cache, and check its bits against torch's at first use.
"""
import argparse
import math
import statistics
import time

import torch

SOURCE = r'''
#include <torch/extension.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
using Vec = at::vec::Vectorized<float>;
void step(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double decay, double w,
          double beta2, double val, double bc2s, double eps, double neg_step) {
  float* P = p.data_ptr<float>(); const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>(); float* V = v.data_ptr<float>();
  const int64_t n = p.numel();
  const Vec s_decay((float)decay), s_w((float)w), s_1mw(1.0f - (float)w), s_b2((float)beta2),
            s_val((float)val), s_bc((float)bc2s), s_eps((float)eps), s_ns((float)neg_step);
  const bool small = std::abs((float)w) < 0.5f;
  TORCH_CHECK(n % Vec::size() == 0, "length must be a multiple of the vector size");
  for (int64_t i = 0; i < n; i += Vec::size()) {
    Vec pv = Vec::loadu(P + i) * s_decay;
    Vec gv = Vec::loadu(G + i), mv = Vec::loadu(M + i);
    Vec diff = gv - mv;
    mv = small ? at::vec::fmadd(s_w, diff, mv) : at::vec::fnmadd(s_1mw, diff, gv);
    Vec vv = at::vec::fmadd(s_val * gv, gv, Vec::loadu(V + i) * s_b2);
    Vec d = vv.sqrt() / s_bc + s_eps;
    pv = pv + s_ns * mv / d;
    pv.store(P + i); mv.store(M + i); vv.store(V + i);
  }
}
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 22)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from torch.utils.cpp_extension import load_inline
    flags = ["-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-ffp-contract=off",
             "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    ext = load_inline("zeroshard_adamw_one_pass_probe", cpp_sources=SOURCE, functions=["step"], extra_cflags=flags)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, lr, b1, b2, eps, wd = args.elements, 1e-3, 0.9, 0.999, 1e-8, 0.01
    p0 = torch.randn(n)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    mine, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    t_torch, t_one = [], []
    for k in range(1, args.steps + 1):
        g = torch.randn(n)
        ref.grad = g
        t = time.perf_counter()
        opt.step()
        t_torch.append(time.perf_counter() - t)
        t = time.perf_counter()
        ext.step(mine, g, m, v, 1 - lr * wd, 1 - b1, b2, 1 - b2, math.sqrt(1 - b2 ** k), eps, -(lr / (1 - b1 ** k)))
        t_one.append(time.perf_counter() - t)
        st = opt.state[ref]
        print(f"step {k}: parameter equal {torch.equal(mine, ref.detach())} "
              f"({int((mine != ref.detach()).sum())} of {n} differ), exp_avg equal {torch.equal(m, st['exp_avg'])}, "
              f"exp_avg_sq equal {torch.equal(v, st['exp_avg_sq'])}")
    x = torch.rand(1 << 20)
    print("torch's fp32 sqrt correctly rounded:", torch.equal(x.sqrt(), x.double().sqrt().float()))
    print(f"torch AdamW {statistics.median(t_torch[1:]) * 1e3:.1f} ms, one pass {statistics.median(t_one[1:]) * 1e3:.1f} ms "
          f"({n} elements, one thread)")


if __name__ == "__main__":
    main()
