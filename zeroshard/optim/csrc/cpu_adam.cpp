// One pass of AdamW over fp32 tensors on the CPU, optionally also writing a 16-bit copy of the
// updated parameter (the copy that goes back to the accelerator), on torch's own CPU thread pool
// (at::parallel_for: it honours torch.set_num_threads).
// Per element: read param, grad, exp_avg, exp_avg_sq; write them back (grad excepted) and the copy:
// 28 bytes with an fp32 gradient, 26 with a 16-bit one; 2 more with a 16-bit copy.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Round to nearest even; NaN stays NaN. Branch-free so the loop below vectorises.
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

constexpr int64_t kGrain = 1 << 15;  // elements per task: 128 KiB of each fp32 stream

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The gradient as fp32, times s1 then s2 (two roundings, as two in-place multiplies in torch give:
// the file is built with -ffp-contract=off so neither product is fused into a later operation).
template <typename G>
inline float load_grad(const G* g, int64_t i, float s1, float s2);
template <>
inline float load_grad<float>(const float* g, int64_t i, float s1, float s2) { return (g[i] * s1) * s2; }
template <>
inline float load_grad<c10::BFloat16>(const c10::BFloat16* g, int64_t i, float s1, float s2) {
  return (bf16_bits_to_float(g[i].x) * s1) * s2;
}
template <>
inline float load_grad<c10::Half>(const c10::Half* g, int64_t i, float s1, float s2) {
  return (static_cast<float>(g[i]) * s1) * s2;
}

template <int COPY, typename G>  // COPY 0: no copy, 1: bf16, 2: fp16; G: the gradient's type
void adamw_loop(float* __restrict p, const G* __restrict g, float* __restrict m,
                float* __restrict v, uint16_t* __restrict out, int64_t n, float lr, float beta1,
                float beta2, float eps, float wd, float step_size, float inv_bc2_sqrt, float s1, float s2) {
  const float decay = 1.0f - lr * wd;
  const float one_minus_b1 = 1.0f - beta1;
  const float one_minus_b2 = 1.0f - beta2;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gi = load_grad<G>(g, i, s1, s2);
    float pi = p[i] * decay;
    const float mi = m[i] + one_minus_b1 * (gi - m[i]);
    const float vi = beta2 * v[i] + one_minus_b2 * gi * gi;
    const float denom = std::sqrt(vi) * inv_bc2_sqrt + eps;
    pi = pi - step_size * mi / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (COPY == 1) out[i] = to_bf16_bits(pi);
    if constexpr (COPY == 2) out[i] = c10::Half(pi).x;
  }
  });
}

}  // namespace

template <int COPY>
void dispatch_grad(torch::Tensor param, torch::Tensor grad, float* m, float* v, uint16_t* out, const float* args,
                   float step_size, float bc2_sqrt, float s1, float s2) {
  auto* p = param.data_ptr<float>();
  const int64_t n = param.numel();
  switch (grad.scalar_type()) {
    case torch::kFloat32:
      adamw_loop<COPY, float>(p, grad.data_ptr<float>(), m, v, out, n, args[0], args[1], args[2], args[3],
                              args[4], step_size, bc2_sqrt, s1, s2);
      break;
    case torch::kBFloat16:
      adamw_loop<COPY, c10::BFloat16>(p, grad.data_ptr<c10::BFloat16>(), m, v, out, n, args[0], args[1], args[2],
                                      args[3], args[4], step_size, bc2_sqrt, s1, s2);
      break;
    case torch::kHalf:
      adamw_loop<COPY, c10::Half>(p, grad.data_ptr<c10::Half>(), m, v, out, n, args[0], args[1], args[2], args[3],
                                  args[4], step_size, bc2_sqrt, s1, s2);
      break;
    default:
      TORCH_CHECK(false, "zeroshard cpu_adam: the gradient must be fp32, bf16 or fp16");
  }
}

// step is the step number after this update (1 for the first update). The gradient (fp32, bf16 or
// fp16) is read as fp32 times grad_scale1 then grad_scale2, in the same pass: a 16-bit gradient is
// never widened into an fp32 copy first (2 bytes read per element instead of 2 + 4 + 8).
void adamw_(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
            c10::optional<torch::Tensor> copy16, double lr, double beta1, double beta2, double eps,
            double weight_decay, int64_t step, double grad_scale1, double grad_scale2) {
  for (const auto& t : {param, exp_avg, exp_avg_sq}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
                "zeroshard cpu_adam: expects contiguous fp32 CPU tensors");
    TORCH_CHECK(t.numel() == param.numel(), "zeroshard cpu_adam: size mismatch");
  }
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == param.numel(),
              "zeroshard cpu_adam: the gradient must be a contiguous CPU tensor of the parameter's size");
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float step_size = static_cast<float>(lr / bc1);
  const float bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));  // passed as its inverse
  auto* m = exp_avg.data_ptr<float>();
  auto* v = exp_avg_sq.data_ptr<float>();
  const float args[] = {(float)lr, (float)beta1, (float)beta2, (float)eps, (float)weight_decay};
  const float s1 = static_cast<float>(grad_scale1), s2 = static_cast<float>(grad_scale2);
  if (!copy16.has_value()) {
    dispatch_grad<0>(param, grad, m, v, nullptr, args, step_size, bc2_sqrt, s1, s2);
    return;
  }
  auto& c = *copy16;
  TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.numel() == param.numel(),
              "zeroshard cpu_adam: the 16-bit copy must be a contiguous CPU tensor of the same size");
  auto* out = reinterpret_cast<uint16_t*>(c.data_ptr());
  if (c.scalar_type() == torch::kBFloat16) {
    dispatch_grad<1>(param, grad, m, v, out, args, step_size, bc2_sqrt, s1, s2);
  } else {
    TORCH_CHECK(c.scalar_type() == torch::kHalf, "zeroshard cpu_adam: copy must be bf16 or fp16");
    dispatch_grad<2>(param, grad, m, v, out, args, step_size, bc2_sqrt, s1, s2);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the delayed update runs this in a background thread while the main thread
  // keeps queueing the device's forward and backward.
  m.def("adamw_", &adamw_, "AdamW step in place, optionally writing a 16-bit copy",
        py::call_guard<py::gil_scoped_release>());
}
