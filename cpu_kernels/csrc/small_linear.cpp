// torch.ops.moelight.small_linear: y = x W^T + b for a bf16 weight W [N, K] and a few rows of x
// (at most kSmallLinearRows), the decode-time matmuls of a CPU whose oneDNN packs no bf16 weights.
// There the engine keeps a packed float32 copy for large batches; reading the bf16 weight itself
// moves half the bytes, and at a few rows the matmul is bound by those bytes. Output rows are the
// float32 sums (plus bias) rounded to x's dtype, as the float32-copy path rounds them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <string>

#include "kernels.h"

namespace moelight {

constexpr int64_t kSmallLinearRows = 4;
// Output rows per thread at least: 64 rows of a 1024-wide weight are 128 KB, enough to amortise a
// thread's start; a K/V projection (a few hundred rows) still splits across the threads.
constexpr int64_t kRowsPerThread = 64;

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(std::strcmp(active_isa(), "none") != 0, "moelight: small_linear needs AVX2 or newer");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "moelight: small_linear wants a contiguous bf16 weight [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.size(-1) == k, "moelight: small_linear input has " + std::to_string(x.size(-1)) +
                                   " features, the weight " + std::to_string(k));
  const at::Tensor xf = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = xf.size(0);
  TORCH_CHECK(m <= kSmallLinearRows, "moelight: small_linear takes at most " + std::to_string(kSmallLinearRows) +
                                         " rows, got " + std::to_string(m));
  auto y = at::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const bool wide = std::strcmp(active_isa(), "avx2") != 0;  // an AVX-512 level
  if (m > 0) {
    at::parallel_for(0, n, kRowsPerThread, [&](int64_t n0, int64_t n1) {
      (wide ? small_linear_rows_avx512 : small_linear_rows_avx2)(xp, m, wp, n0, n1, k, yp, n);
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return y.to(x.scalar_type()).view(sizes);
}

}  // namespace moelight
