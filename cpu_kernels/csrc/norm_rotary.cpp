// The element-wise work between a decode step's matmuls, one pass each instead of torch's chain of
// small ops (at batch 1 each op's dispatch costs more than its arithmetic: the norms and rotary took
// ~10% of an int4 decode step of bench-1b).
//
// rotary: x * cos + rotate_half(x) * sin, each product rounded to x's dtype and then the sum, as the
// three torch ops round them: the same values bit for bit in every dtype (no FMA contraction).
// rms_norm: transformers' RMSNorm for 16-bit activations: w * bf16(x * rsqrt(mean(x^2) + eps)), the
// mean in float32. Its sum runs in another order than torch's, so a 16-bit output can differ from
// torch's by one rounding step where the two means differ in their last bit; float32 models keep
// torch's norm (engine runs are exact against transformers there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <string>

namespace moelight {
namespace {

// Rounding through the dtype as torch's element-wise ops round their results.
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}
template <>
inline float rounded<float>(float v) {
  return v;
}

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotary_rows(const T* x, const T* cos, const T* sin, T* out,
                                                              int64_t heads, int64_t d, int64_t x_head) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * x_head;
    T* oh = out + h * d;
    for (int64_t i = 0; i < d; ++i) {
      const float xi = static_cast<float>(xh[i]);
      const float rot = i < half ? -static_cast<float>(xh[i + half]) : static_cast<float>(xh[i - half]);
      const float a = rounded<T>(xi * static_cast<float>(cos[i]));
      const float b = rounded<T>(rot * static_cast<float>(sin[i]));
      oh[i] = static_cast<T>(a + b);
    }
  }
}

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      lane[l] += v * v;
    }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lane[l];
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j)
    out[j] = static_cast<T>(static_cast<float>(w[j]) * rounded<T>(static_cast<float>(x[j]) * inv));
}

}  // namespace

// x [T, H, d] (d contiguous, rows and heads strided), cos / sin [T, d] contiguous in x's dtype -> [T, H, d].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "moelight: rotary wants x [T, H, d] with d contiguous");
  const int64_t T = x.size(0), H = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == d,
              "moelight: rotary wants cos / sin [T, d] for x [T, H, d], d even");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "moelight: rotary wants cos / sin in x's dtype");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({T, H, d}, x.options());
  const int64_t xr = x.stride(0), xh = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moelight_rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = s.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * d));
    at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        rotary_rows<scalar_t>(xp + t * xr, cp + t * d, sp + t * d, op + t * H * d, H, d, xh);
    });
  });
  return out;
}

// x [..., n] in bf16 / fp16, w [n] in x's dtype -> [..., n].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "moelight: rms_norm is for 16-bit activations (float32 keeps torch's)");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type(),
              "moelight: rms_norm wants a weight [n] in x's dtype for x [..., n]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  at::Tensor out = at::empty_like(xc);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "moelight_rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rms_norm_row<scalar_t>(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

}  // namespace moelight
