"""Probe (issue 34, not used by zeroshard): can one pass over memory give the bits of torch's
single-tensor AdamW on the CPU, which DDP and zeroshard's tiled step both run (seven passes)?

    python bench/adamw_one_pass_probe.py [--elements 4194304] [--block 4096]

Builds a small C++ kernel (torch's extension builder, ATen's Vectorized<float>) that applies, per
element, the operations of torch.optim.adam._single_tensor_adam as ATen's CPU kernels compute them
(found one by one on an AVX-512 Xeon, torch 2.13: lerp_ is fmadd(w, end - self, self); addcmul_ is
fmadd(value * t1, t2, self); a tensor divided by a Python float divides by that float in fp32;
addcdiv_ is self + (value * t1) / t2; sqrt is MKL's vmsSqrt in its high-accuracy mode, at/cpu/vml.h,
not the correctly rounded _mm512_sqrt_ps). Two forms: `one pass` takes its sqrt from the vector
instruction; `blocked` runs the moments over a block of elements that stays in cache, the block's
sqrt through vmsSqrt (found in libtorch_cpu where torch is built with MKL), then the parameter.
Both step beside torch.optim.AdamW on random data (gradients at three scales), printing whether
parameter, exp_avg and exp_avg_sq are bit-equal at each step, and the times.

Finding (2026-12-01, 2-core Xeon, one thread, `--elements 23240704`, gpt2-small-cpu's size, 6
steps): `blocked` is bit-equal to torch at every step (parameter and both moments), 40.8 ms against
torch's 192.9 ms here, where torch steps one 23M-element tensor (a fresh temporary of that size per
operation); inside the engine, stepping tiles, torch's AdamW took 93-98 ms on the same elements.
`one pass` has the moments bit-equal but not the parameter (435 of 23.2M elements after a step),
its sqrt being the correctly rounded one. A step for real would check its bits against torch's at
first use (a torch without MKL, another CPU) and fall back to torch's.
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
#include <algorithm>
#include <vector>
using Vec = at::vec::Vectorized<float>;
extern "C" void vmsSqrt(const int64_t n, const float* a, float* r, const int64_t mode) __attribute__((weak));
const int64_t VML_MODE = 0x2 | 0x00140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE, as vml.h calls it

struct Scalars {
  Vec decay, w, one_minus_w, beta2, value, bc2_sqrt, eps, neg_step; bool small;
  Scalars(double d, double w_, double b2, double val, double bc, double e, double ns)
    : decay((float)d), w((float)w_), one_minus_w(1.0f - (float)w_), beta2((float)b2), value((float)val),
      bc2_sqrt((float)bc), eps((float)e), neg_step((float)ns), small(std::abs((float)w_) < 0.5f) {}
};

static inline void moments(const Scalars& s, const float* G, float* M, float* V, int64_t i) {
  Vec gv = Vec::loadu(G + i), mv = Vec::loadu(M + i);
  Vec diff = gv - mv;
  mv = s.small ? at::vec::fmadd(s.w, diff, mv) : at::vec::fnmadd(s.one_minus_w, diff, gv);
  Vec vv = at::vec::fmadd(s.value * gv, gv, Vec::loadu(V + i) * s.beta2);
  mv.store(M + i); vv.store(V + i);
}

static inline void param(const Scalars& s, float* P, const float* M, Vec root, int64_t i) {
  Vec d = root / s.bc2_sqrt + s.eps;
  (Vec::loadu(P + i) * s.decay + s.neg_step * Vec::loadu(M + i) / d).store(P + i);
}

static void check(const torch::Tensor& p) {
  TORCH_CHECK(p.numel() % Vec::size() == 0, "length must be a multiple of the vector size");
}

void one_pass(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double decay, double w,
              double beta2, double val, double bc2s, double eps, double neg_step) {
  check(p);
  const Scalars s(decay, w, beta2, val, bc2s, eps, neg_step);
  float* P = p.data_ptr<float>(); const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>(); float* V = v.data_ptr<float>();
  for (int64_t i = 0; i < p.numel(); i += Vec::size()) {
    moments(s, G, M, V, i);
    param(s, P, M, Vec::loadu(V + i).sqrt(), i);
  }
}

bool has_vml() { return vmsSqrt != nullptr; }

void blocked(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, double decay, double w,
             double beta2, double val, double bc2s, double eps, double neg_step, int64_t block) {
  check(p);
  TORCH_CHECK(vmsSqrt != nullptr, "no vmsSqrt in this torch (built without MKL)");
  const Scalars s(decay, w, beta2, val, bc2s, eps, neg_step);
  float* P = p.data_ptr<float>(); const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>(); float* V = v.data_ptr<float>();
  std::vector<float> root(block);
  for (int64_t a = 0; a < p.numel(); a += block) {
    const int64_t len = std::min(block, p.numel() - a);
    for (int64_t i = a; i < a + len; i += Vec::size()) moments(s, G, M, V, i);
    vmsSqrt(len, V + a, root.data(), VML_MODE);
    for (int64_t i = a; i < a + len; i += Vec::size()) param(s, P, M, Vec::loadu(root.data() + (i - a)), i);
  }
}
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 22)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--block", type=int, default=4096, help="elements per block of the blocked form (a multiple of 16)")
    args = ap.parse_args()
    from torch.utils.cpp_extension import load_inline
    flags = ["-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-ffp-contract=off",
             "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    ext = load_inline("zeroshard_adamw_one_pass_probe", cpp_sources=SOURCE, functions=["one_pass", "blocked", "has_vml"],
                      extra_cflags=flags)
    torch.set_num_threads(1)
    forms = {"one pass": lambda *a: ext.one_pass(*a)}
    if ext.has_vml():
        forms["blocked"] = lambda *a: ext.blocked(*a, args.block)
    else:
        print("no vmsSqrt in this torch: the blocked form is left out")
    n, lr, b1, b2, eps, wd = args.elements, 1e-3, 0.9, 0.999, 1e-8, 0.01
    for name, step in forms.items():
        torch.manual_seed(0)
        p0 = torch.randn(n)
        ref = torch.nn.Parameter(p0.clone())
        opt = torch.optim.AdamW([ref], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        mine, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        t_torch, t_mine = [], []
        for k in range(1, args.steps + 1):
            g = torch.randn(n) * 10.0 ** (k % 3 - 1)
            ref.grad = g
            t = time.perf_counter()
            opt.step()
            t_torch.append(time.perf_counter() - t)
            t = time.perf_counter()
            step(mine, g, m, v, 1 - lr * wd, 1 - b1, b2, 1 - b2, math.sqrt(1 - b2 ** k), eps, -(lr / (1 - b1 ** k)))
            t_mine.append(time.perf_counter() - t)
            st = opt.state[ref]
            print(f"{name}, step {k}: parameter equal {torch.equal(mine, ref.detach())} "
                  f"({int((mine != ref.detach()).sum())} of {n} differ), exp_avg equal {torch.equal(m, st['exp_avg'])}, "
                  f"exp_avg_sq equal {torch.equal(v, st['exp_avg_sq'])}")
        print(f"{name}: torch AdamW {statistics.median(t_torch[1:]) * 1e3:.1f} ms, "
              f"{name} {statistics.median(t_mine[1:]) * 1e3:.1f} ms ({n} elements, one thread)")
    x = torch.rand(1 << 20)
    print("torch's fp32 sqrt correctly rounded:", torch.equal(x.sqrt(), x.double().sqrt().float()))


if __name__ == "__main__":
    main()
