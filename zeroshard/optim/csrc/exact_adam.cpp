// torch's single-tensor Adam/AdamW step (torch.optim.adam._single_tensor_adam, non-capturable,
// no amsgrad) over fp32 CPU tensors in one pass over memory, with torch's bits.
//
// torch runs that step as seven whole-tensor kernels (mul_, lerp_, mul_, addcmul_, sqrt, div,
// add_, addcdiv_), each reading and writing every element; here each element is read and written
// once. The bits are torch's because each operation is written as ATen's CPU kernel computes it
// per element (an element's result does not depend on the vector width; the file is built with
// FMA, so Vectorized's fmadd rounds once as ATen's does, and with -ffp-contract=off, so nothing
// else is fused):
//   param.mul_(decay)              P * decay
//   exp_avg.lerp_(grad, w)         fmadd(w, g - m, m) when |w| < 0.5, else fmadd(w - 1, g - m, g)
//   exp_avg_sq.mul_(b2).addcmul_   fmadd(value * g, g, v * b2)
//   sqrt                           MKL's vmsSqrt in high-accuracy mode, as ATen/cpu/vml.h calls it
//                                  (not the correctly rounded vector sqrt: that differs in the last bit)
//   / bc2_sqrt, .add_(eps)         fp32 division by the float, fp32 add
//   param.addcdiv_(m, d, value)    P + (value * m) / d
// The sqrt needs a block of results at a time, so the step runs block by block: the moments of
// BLOCK elements, their sqrt, then the parameters, while the block is still in cache.
// exact_adam.py checks these bits against torch's own step before using them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

// MKL's own declaration takes n as MKL_INT (int in LP64 builds): an int64 in the register carries
// the same low 32 bits and is right for ILP64 too. Weak: null where torch has no MKL.
extern "C" void vmsSqrt(const int64_t n, const float* a, float* r, const int64_t mode) __attribute__((weak));

namespace {

using Vec = at::vec::Vectorized<float>;
// VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: the mode ATen/cpu/vml.h passes
constexpr int64_t kVmlMode = 0x2 | 0x00140000 | 0x100;
constexpr int64_t kBlock = 4096;  // elements: five fp32 streams of a block stay in L1/L2
constexpr int64_t kGrainBlocks = 8;  // blocks per task (32768 elements, ATen's grain size)

bool has_vml() { return vmsSqrt != nullptr; }

void adam_(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v, double decay,
           double w, double beta2, double value, double bc2_sqrt, double eps, double neg_step_size) {
  TORCH_CHECK(vmsSqrt != nullptr, "zeroshard exact_adam: this torch has no vmsSqrt (built without MKL)");
  const int64_t n = p.numel();
  for (const at::Tensor* t : {&p, &g, &m, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n,
                "zeroshard exact_adam: every tensor must be contiguous fp32 on the CPU, of one length");
  }
  TORCH_CHECK(n % Vec::size() == 0, "zeroshard exact_adam: the length must be a multiple of ", Vec::size());
  float* P = p.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const float wf = static_cast<float>(w);
  const bool small = std::abs(wf) < 0.5f;  // ATen's is_lerp_weight_small
  const Vec coeff(small ? wf : wf - 1.0f), vdecay(static_cast<float>(decay)), vbeta2(static_cast<float>(beta2)),
      vvalue(static_cast<float>(value)), vbc2(static_cast<float>(bc2_sqrt)), veps(static_cast<float>(eps)),
      vstep(static_cast<float>(neg_step_size));
  const bool decays = decay != 1.0;  // torch skips the multiply when weight_decay is 0
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    alignas(64) float root[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, len = std::min(kBlock, n - lo);
      for (int64_t i = lo; i < lo + len; i += Vec::size()) {
        const Vec gv = Vec::loadu(G + i), mv = Vec::loadu(M + i);
        at::vec::fmadd(coeff, gv - mv, small ? mv : gv).store(M + i);
        at::vec::fmadd(vvalue * gv, gv, Vec::loadu(V + i) * vbeta2).store(V + i);
      }
      vmsSqrt(len, V + lo, root, kVmlMode);
      for (int64_t i = lo; i < lo + len; i += Vec::size()) {
        const Vec pv = decays ? Vec::loadu(P + i) * vdecay : Vec::loadu(P + i);
        const Vec d = Vec::loadu(root + (i - lo)) / vbc2 + veps;
        (pv + vstep * Vec::loadu(M + i) / d).store(P + i);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(zeroshard_exact_adam, lib) {
  lib.def("has_vml() -> bool", &has_vml);
  lib.def("adam_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, float decay, float w, "
          "float beta2, float value, float bc2_sqrt, float eps, float neg_step_size) -> ()",
          &adam_);
}
